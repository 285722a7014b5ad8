"""The chaos run (`make chaos`): the production shape under load and a seeded random schedule of faults,
then a history check.

* servers.py: its own Postgres cluster and redis-server (never the shared ones: it restarts, flushes and
  fills them), a TCP proxy in front of both that cuts or stalls the links, a tmpfs for the event log's
  tablespace;
* load.py: the clients and what they saw; faults.py: the seeded schedule; checker.py: the check;
* wider.py: issue 36's faults on a third worker (a poison request, a model that cannot load), slow
  followers through a throttled link, the fair-share ledger; pair.py: Postgres as a primary and a
  synchronous standby, and the failover fault (its own schedule: LMSP_CHAOS_PAIR=1);
* __main__.py: the run. LMSP_CHAOS_SECONDS (1200), LMSP_CHAOS_SEED (random, printed), LMSP_CHAOS_FAULTS
  (a comma-separated subset of faults.KINDS; postgres_failover among them runs on a pair),
  LMSP_CHAOS_PAIR (1: on a pair, with every fault but disk_full), LMSP_CHAOS_SETTLE_SECONDS (420).
"""

"""The api's token cache (api/token_cache.py) without Redis: what it keeps, for how long, and what an
invalidation removes. Revocation across processes is tested on the real stack (test_token_cache.py)."""

from api import token_cache
from api.token_cache import TokenCache
from common.tokens import Identity

ALICE, BOB = Identity("tok_a", "alice", frozenset({"tasks:read"})), Identity("tok_b", "bob", frozenset())


class Quiet:
    def apply_pending(self):
        pass


def cache(expiry=5.0, revoked=None):
    made = TokenCache("redis://127.0.0.1:1/0", expiry, on_revoked=revoked)
    made._listener = Quiet()  # no Redis: invalidations are called by hand
    return made


def test_without_redis_nothing_is_cached():
    made = TokenCache("", 5.0)
    made.put("a", ALICE, made.begin())
    assert made.get("a") is None


def test_an_entry_is_trusted_for_the_expiry_counted_from_before_its_lookup(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(token_cache.time, "monotonic", lambda: now[0])
    made = cache()
    begun = made.begin()
    now[0] = 101.0  # the lookup took a second
    made.put("a", ALICE, begun)
    assert made.get("a") == ALICE
    now[0] = 104.9
    assert made.get("a") == ALICE
    now[0] = 105.0
    assert made.get("a") is None


def test_a_lookup_that_straddles_an_invalidation_is_not_kept():
    made = cache()
    begun = made.begin()
    made._invalidate("tok_a")  # the revoke committed after the lookup read the row
    made.put("a", ALICE, begun)
    assert made.get("a") is None
    made.put("a", ALICE, made.begin())
    assert made.get("a") == ALICE


def test_an_invalidation_removes_its_token_and_a_resubscription_every_token():
    told = []
    made = cache(revoked=told.append)
    made.put("a", ALICE, made.begin())
    made.put("a2", ALICE, made.begin())  # the same token under another hash cannot be, but its id is what counts
    made.put("b", BOB, made.begin())
    made._invalidate("tok_a")
    assert (made.get("a"), made.get("a2"), made.get("b")) == (None, None, BOB) and told == ["tok_a"]
    made._invalidate(None)
    assert made.get("b") is None and told == ["tok_a"]

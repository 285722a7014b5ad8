-- KEDA's database role: it reads how many tasks each model has queued and running, and nothing else.
-- Run once as the owner of the lmsp database (psql "$LMSP_DATABASE_URL" -v password=... -f k8s/keda-role.sql);
-- its login goes in the Secret lmsp-keda-postgres (keda-secret.env.example).
CREATE ROLE lmsp_keda LOGIN PASSWORD :'password';
DO $$ BEGIN EXECUTE format('GRANT CONNECT ON DATABASE %I TO lmsp_keda', current_database()); END $$;
GRANT USAGE ON SCHEMA public TO lmsp_keda;
GRANT SELECT (model, status) ON tasks TO lmsp_keda;
ALTER ROLE lmsp_keda SET default_transaction_read_only = on;

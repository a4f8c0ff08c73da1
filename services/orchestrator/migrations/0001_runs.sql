-- Runs, their events, per-step metrics, recorded samples and dataloader state.
CREATE TABLE runs (
    id uuid PRIMARY KEY,
    name text,
    algorithm text NOT NULL,
    spec jsonb NOT NULL,
    status text NOT NULL CHECK (status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')),
    reason text,
    -- Steps completed: metrics are recorded for steps 1..=step.
    step bigint NOT NULL DEFAULT 0,
    total_steps bigint NOT NULL,
    -- The orchestrator instance driving the run, renewed every few seconds; a run whose
    -- heartbeat is older than the lease is taken over (resumed) by another instance.
    owner uuid,
    heartbeat_at timestamptz,
    -- The trainer worker the run holds (claimed again by name when the run resumes).
    trainer_worker text,
    cancel_requested boolean NOT NULL DEFAULT false,
    -- Times the run was started or resumed.
    attempts integer NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX runs_by_status ON runs (status, created_at);
CREATE INDEX runs_by_created ON runs (created_at DESC, id DESC);

CREATE TABLE run_events (
    seq bigserial PRIMARY KEY,
    run_id uuid NOT NULL REFERENCES runs ON DELETE CASCADE,
    at timestamptz NOT NULL DEFAULT now(),
    event jsonb NOT NULL
);
CREATE INDEX run_events_by_run ON run_events (run_id, seq);

CREATE TABLE metrics (
    run_id uuid NOT NULL REFERENCES runs ON DELETE CASCADE,
    name text NOT NULL,
    step bigint NOT NULL,
    value double precision NOT NULL,
    PRIMARY KEY (run_id, name, step)
);

CREATE TABLE samples (
    run_id uuid NOT NULL REFERENCES runs ON DELETE CASCADE,
    step bigint NOT NULL,
    split text NOT NULL,
    idx integer NOT NULL,
    prompt text NOT NULL,
    completion text NOT NULL,
    reward double precision NOT NULL,
    ground_truth text,
    finish_reason text,
    PRIMARY KEY (run_id, step, split, idx)
);

CREATE TABLE dataloader_state (
    run_id uuid PRIMARY KEY REFERENCES runs ON DELETE CASCADE,
    step bigint NOT NULL,
    state jsonb NOT NULL
);

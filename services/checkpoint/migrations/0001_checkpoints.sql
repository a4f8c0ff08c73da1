-- The checkpoint service's own schema (the connection's search_path is `checkpoint`).

-- A run's retention policy (absent: keep everything).
CREATE TABLE runs (
    run_id text PRIMARY KEY,
    keep_top_k integer NOT NULL,
    metric text NOT NULL,
    higher_is_better boolean NOT NULL
);

CREATE TABLE checkpoints (
    id uuid PRIMARY KEY,
    run_id text NOT NULL,
    step bigint NOT NULL,
    status text NOT NULL CHECK (status IN ('pending', 'complete')),
    metrics jsonb NOT NULL DEFAULT '{}',
    info jsonb NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX checkpoints_by_run ON checkpoints (run_id, status, step);

-- A checkpoint's files; `uploaded` once the blob with that sha256 is stored for it.
CREATE TABLE files (
    checkpoint_id uuid NOT NULL REFERENCES checkpoints (id) ON DELETE CASCADE,
    path text NOT NULL,
    sha256 text NOT NULL,
    size bigint NOT NULL,
    uploaded boolean NOT NULL DEFAULT false,
    PRIMARY KEY (checkpoint_id, path)
);
CREATE INDEX files_by_sha ON files (sha256);

-- Stored contents, by sha256 (identical files are stored once).
CREATE TABLE blobs (
    sha256 text PRIMARY KEY,
    size bigint NOT NULL
);

-- Readers: a leased checkpoint is never deleted.
CREATE TABLE leases (
    id uuid PRIMARY KEY,
    checkpoint_id uuid NOT NULL REFERENCES checkpoints (id) ON DELETE CASCADE,
    holder text NOT NULL,
    expires_at timestamptz NOT NULL
);
CREATE INDEX leases_by_checkpoint ON leases (checkpoint_id, expires_at);

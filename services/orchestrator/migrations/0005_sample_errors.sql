-- Why a sample's scoring failed (an HTTP plugin down, an agent that timed out or went past a
-- limit), and whether it was dropped from training for it (sample mask 0). Samples recorded
-- before this migration have neither.
ALTER TABLE samples
    ADD COLUMN error text,
    ADD COLUMN dropped boolean;

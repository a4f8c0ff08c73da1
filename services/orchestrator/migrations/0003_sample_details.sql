-- What a sample is made of beyond its text: the named reward components and `info` its
-- environment (or reward plugin) reported, every turn after the prompt with its role, its
-- token counts (prompt, generated — the tokens the loss covers — and all) and whether it was
-- cut at the maximum length. Samples recorded before this migration have none of them.
ALTER TABLE samples
    ADD COLUMN rewards jsonb NOT NULL DEFAULT '{}',
    ADD COLUMN info jsonb,
    ADD COLUMN turns jsonb NOT NULL DEFAULT '[]',
    ADD COLUMN num_prompt_tokens bigint,
    ADD COLUMN num_generated_tokens bigint,
    ADD COLUMN num_tokens bigint,
    ADD COLUMN truncated boolean;

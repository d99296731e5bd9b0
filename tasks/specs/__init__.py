"""Data and specs: a route spec (spec), its verifiers (verifiers), how prompts are rendered (render), tokenizers
(tokenizer) and the prompt set every stage reads (prompt_set). Above common only."""

"""Text prompts as token ids, for the precise prefix scorer: the router's own tokenizers
(`prompts`), the cache of tokenized prompts (`cache`), and workers' `/tokenize` (`client`)."""

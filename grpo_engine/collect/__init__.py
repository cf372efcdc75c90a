"""Group collection: prompts from the stream, G completions each from the sampler (single- or multi-turn), each
scored by the task's guarded reward, groups filtered; the curriculum that scores a pool with the same sampler."""

"""The Hugging Face boundary: nothing outside this package reads or writes a Hugging Face file.

``files`` (safetensors weight files, the atomic and streamed writers, ``HFWeightsError``), ``names``
(the one table of bundled <-> Hugging Face names, and the bundled Llama's loader), ``config``
(config.json as a ``LlamaConfig``), ``sharded`` (the manager route's Hugging Face models: load slice
by slice, save consolidated), ``export`` (exported directories: a full model, a merged LoRA model, a
PEFT adapter) and ``random_model`` (a random model directory and tokenizer, nothing downloaded).
Imported module by module; this file re-exports nothing.
"""

"""From the command line to a worker: parsing, the launcher, the worker process, `mfsdp plan`, user errors."""

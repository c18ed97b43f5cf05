"""Start-up only: ``python -m server`` (cli, its flags in settings, phases), the child-process
lifetime (process) and the embedded model (model_cache). May import anything in server/."""

"""What the run is: its config sections, recipes, resolution (once), preflight checks, the disk, the run directory, determinism."""

"""What a user runs: the ``specgate`` CLI and its commands."""

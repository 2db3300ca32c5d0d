"""``kvserve plan``: how much context fits for how many users, per memory size and weight precision."""

"""Checkpoints: the door for files a user did not write, writing, finding and rebuilding."""

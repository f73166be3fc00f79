"""Will it fit: the memory plan of a run and advice when it does not."""

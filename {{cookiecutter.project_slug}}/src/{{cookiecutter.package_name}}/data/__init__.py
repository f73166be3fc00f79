"""LightningDataModules. Each reads its data in its real on-disk format."""

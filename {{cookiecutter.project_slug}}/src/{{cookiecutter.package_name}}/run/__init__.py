"""Where a run lives and how it starts: names, lock, record, settings checks, stop signals, the machine, the steps the recipes share."""

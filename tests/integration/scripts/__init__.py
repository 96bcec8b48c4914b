"""Worker scripts that the multi-process tests launch (each rank runs one); not collected by pytest."""

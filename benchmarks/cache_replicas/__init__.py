"""Where AutoCache's hits come from when a node runs several replicas: this process's memory or the shared directory."""

"""Engine integrations. Each imports its engine only when it is used, so
``import kvd`` never needs one installed."""

"""Secure aggregation (SecAgg+, Bell et al. CCS 2020): pairwise masks that cancel only in a cluster's sum."""

"""Sharing checkpoints between nodes: manifests, the HTTP sidecar, and live recovery."""

"""Consolidated, layout-independent views of a snapshot: global tensors assembled from their fragments."""

"""Consolidated, layout-independent views of a snapshot: global tensors (or pieces of them) assembled from their
fragments, resharding onto another layout, and export to the formats stock tools load."""

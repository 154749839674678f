"""Thin adapters from training frameworks to inmem_ft's layers; each imports its framework lazily."""

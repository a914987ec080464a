"""Shared plumbing every room uses: atomic files, resumable journals, cache dirs, seeds, plots."""

"""Which drafts to verify: verification policies (Algorithm 1 and baselines), the SPS cost profile, a simulator."""

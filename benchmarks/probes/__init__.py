"""Probes of SAECache's mechanisms that docs/saecache-real-traces.md cites: each a subclass of the policy (so it runs on
the Python engine: the compiled twins are registered for the exact classes) with one mechanism changed, and a switch
that restores the default, whose numbers then equal SAECache's in every cell. Not part of the package; importable as
``probes.NAME`` where this folder's parent is on the path, as it is for the scripts beside it:

    python benchmarks/gap_table.py --capacities 0.02,0.05,0.1,0.2 --policies lru,lpc,saecache,belady --criteria \\
        --variant h15:policy=probes.horizon:Horizon,horizon_sigmas=1.5
"""

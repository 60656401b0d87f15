"""ple's command-line tools, installed as the package ``ple_tools`` with console scripts:

    ple-demo                tools/demo.py: the main job, cold and warm gathers with each policy
    ple-make-table          tools/make_table.py: writes a table of random FP8 rows
    ple-bench-gather        tools/bench_gather.py: the gather against the disk
    ple-bench-gpu           tools/bench_gpu.py: the GPU benchmark
    ple-bench-layers        tools/bench_layers.py: an n-gram layer in a serving loop
    ple-tiny-model          tools/tiny_model.py: a tiny model in every execution mode
    ple-bench-transformers  tools/bench_transformers.py: a transformers model with large tables

Each also runs as ``python -m ple_tools.<name>`` and, from a checkout, as
``python tools/<name>.py``.  A tool's module imports only the standard
library at its top, so that ``--help`` answers without importing torch; the
rest is imported once the arguments are parsed.  The tools are a package of
their own, beside ``ple``, for the same reason: importing ``ple`` registers
``torch.ops.ple``, which imports torch.
"""

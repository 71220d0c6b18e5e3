"""Benchmarks, run as ``fedge bench NAME [--json] [--quick]`` (each module here is one NAME).

Each measures its subject and a baseline in the same run, reports ratios (these machines are noisy), shows a
rich table and, with ``--json``, prints one JSON object with a ``headline`` as the last line of stdout.
"""

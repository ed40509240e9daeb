"""Helpers shared by the test modules (test modules import these, never each other):

- ``procs``: starting and stopping real processes by pid (``run_cli``, a ``join`` node, a
  cluster of nodes on 127.0.0.x), waiting for what their logs say, free ports;
- ``http_client``: a strict HTTP/1.1 client (h11), raw socket exchanges, JSON calls;
- ``netns``: a LAN of network namespaces made for one test, and HTTP into it;
- ``cluster_sim``: a simulated network and clock for the cluster's state machines;
- ``models``: tiny random-weight models (``tiny_model``: ``tiny_base`` for the dense families,
  ``tiny_gemma4`` for Gemma 4 and its assistant) and the test model cache;
- ``hf_cache``: a Hugging Face hub cache laid out as huggingface_hub lays it, from local files,
  and the offline environment pointing at it;
- ``dashboard_demo``: a small cluster on loopback with work, to look at (or screenshot) its
  dashboard: ``python -m tests.helpers.dashboard_demo``.

The session fixtures in tests/conftest.py build the tiny models once per test session.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root

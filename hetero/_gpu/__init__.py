"""The GPU runtime layer: devices, memory, transfers, recording and submission over wgpu-py.

Rules of this package:

* It is private as a whole (``hetero._gpu``), so its modules carry no leading underscore;
  what kernel and pipeline authors may use is re-exported by :mod:`hetero.lowlevel`, and
  graph users get theirs from :mod:`hetero`.
* It never imports the graph and scheduling layer (``hetero._graph``, ``_plan``,
  ``_scheduler``, ``_runtime`` ...); it may import the modules both layers share
  (``hetero.errors``, ``_trace``, ``_bridge``, ``_files``). ``tests/test_layout.py`` checks it.
* Importing the package imports nothing: callers name the module they need.
"""

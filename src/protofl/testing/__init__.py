"""Tools for testing protofl and what is built on it, outside the engine: a multi-node Ray
cluster on one machine (:mod:`protofl.testing.ray_cluster`), which the test suite and the
Ray benchmark start and stop by PID."""

"""What the test files share beyond tests/conftest.py's fixtures: ``nccl`` (an ``nccl`` world over
the double, ranks as threads), ``ports`` (a free TCP port), ``tensor_validation`` (every DTensor
sharding rule checked against NumPy: a harness only tests use, so it lives here, not in the package).
"""

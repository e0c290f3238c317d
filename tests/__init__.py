"""tests: the suite (`make test`): core/ (the library), api/ (the service in process),
client/, integration/ and reliability/ (real redis-server, SeaweedFS, worker and API
processes, started by tests/stack.py), conformance/ (against mergekit), ui/, deploy/.
"""

"""Synchronous and asynchronous SGD (lesson 08).

variants.py          sync SGD, local SGD and the delayed-gradient run, on one least-squares problem
parameter_server.py  asynchronous SGD: a server that holds the weights and workers that push
bench.py             `minidist bench sgd`: stragglers, staleness and time to a loss
"""

"""Simulation mode: engines that run the Flower app with virtual clients on one machine."""

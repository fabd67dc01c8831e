"""Pipeline schedules as data (actions.py), a simulator (simulate.py) and a runner."""

"""The ground floor: errors, the config system, callables named in configs, data files. Imports nothing above."""

"""Bottom of the tree: the refusals' vocabulary (problems), the state folder (paths), progress output (log), text
tables (table) and the base of every config (config_base). Imports nothing else of tasks."""

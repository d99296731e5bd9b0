"""The objective menu: divergences, top-k, corrections and diagnostics over chunked vocabulary (losses). Imports
nothing else of tasks."""

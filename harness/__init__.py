"""The agent task: fetch the job, start the shim, run the harness on the repository, report the result."""

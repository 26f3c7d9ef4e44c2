"""`python -m localrun.cli ...`: the same as the `localrun` console script."""
from localrun.cli.main import main

main()

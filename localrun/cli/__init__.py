"""The `localrun` command line (typer + rich). Thin: parse flags, call the API, render.

    main.py     the app: chat, generate, info, pull, models, and the other commands attached;
                main(), the console script, turns a user's error into one sentence and exit 2
    options.py  the flags chat, generate, serve and plan share, declared once; flags -> EngineConfig
    plan.py     `localrun plan`     serve.py  `localrun serve`    tune.py   `localrun tune`
    bench.py    `localrun bench`    top.py    `localrun top`      cache.py  `localrun cache`

Nothing is imported here, so `localrun.cli.options` loads without the whole app.
"""

from merge_engine.cli import main

raise SystemExit(main())

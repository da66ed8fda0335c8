from qtool.cli.main import main

raise SystemExit(main())

from p2ptrain.cli import main

raise SystemExit(main())

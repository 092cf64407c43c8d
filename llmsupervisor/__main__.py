from llmsupervisor.cli.main import main

raise SystemExit(main())

from p2ptrain.cli import run

run()

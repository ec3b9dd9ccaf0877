from opweave.cli import app

app(prog_name="opweave")

"""Hardware profiles and their sources: fitting a profile to a real server's measurements
(`testbed calibrate`), sampling a timing source such as aiconfigurator into one (`testbed profile`).
The fitting and the sources import only core and config; the commands also read the model's
token syntax and errors. Nothing below imports it."""

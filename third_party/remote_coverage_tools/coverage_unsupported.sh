#!/bin/sh
echo "coverage is not supported in the offline jaxworks build" >&2
exit 1

// Command certsummary prints the certificates table of a ztunnel config dump with istioctl's own
// writer (istioctl/pkg/writer/ztunnel/configdump, what `istioctl ztunnel-config certificates`
// runs), so that meshca's tests compare `meshca certs` with istioctl's output cell for cell
// instead of with a reimplementation of it.
//
// Usage: certsummary < config_dump.json
package main

import (
	"fmt"
	"io"
	"os"

	"istio.io/istio/istioctl/pkg/writer/ztunnel/configdump"
)

func main() {
	dump, err := io.ReadAll(os.Stdin)
	if err != nil {
		fmt.Fprintln(os.Stderr, "certsummary: reading stdin:", err)
		os.Exit(1)
	}
	w := &configdump.ConfigWriter{Stdout: os.Stdout}
	if err := w.Prime(dump); err != nil {
		fmt.Fprintln(os.Stderr, "certsummary:", err)
		os.Exit(1)
	}
	if err := w.PrintSecretSummary(); err != nil {
		fmt.Fprintln(os.Stderr, "certsummary:", err)
		os.Exit(1)
	}
}

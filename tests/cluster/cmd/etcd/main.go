// Command etcd is etcd's own server entry point, built from this module because
// etcd's server module uses directory replaces, so `go install` of it cannot work.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}

// Stand-in for Insight's pch.h: see insight_stubs.h.
#pragma once
#include "insight_stubs.h"
